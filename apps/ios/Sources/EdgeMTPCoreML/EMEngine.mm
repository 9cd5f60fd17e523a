#import "EMEngine.h"

#if !__has_feature(objc_arc)
#error "EMEngine.mm is written for ARC (SwiftPM and Xcode turn it on for packages)"
#endif

#include <atomic>
#include <functional>
#include <memory>
#include <utility>

#include "CoreMLRunner.h"
#include "edgemtp/sha256.h"

#import "EMBridging.h"
#import "EMEngine+Internal.h"

NSErrorDomain const EMErrorDomain = @"dev.edgemtp.sample";

@interface EMGenerateStats ()
- (instancetype)initWithStats:(const edgemtp::GenerateStats&)stats;
@end

@interface EMBundleInfo ()
- (instancetype)initWithName:(NSString*)name
                      config:(const edgemtp::BundleConfig&)config
                computeUnits:(NSString*)computeUnits
                hasTokenizer:(BOOL)hasTokenizer;
@end

// --- stop flag --------------------------------------------------------------------------------

@implementation EMStopFlag {
  std::atomic<bool> _stopRequested;  // false: Objective-C objects start zero-filled
}

- (void)requestStop {
  _stopRequested.store(true);
}

- (BOOL)isStopRequested {
  return _stopRequested.load();
}

@end

// --- options and results ------------------------------------------------------------------------

@implementation EMGenerateOptions

- (instancetype)init {
  if ((self = [super init])) {
    const edgemtp::GenerateOptions defaults;
    _maxNewTokens = defaults.max_new_tokens;
    _depth = defaults.depth;
    _chat = defaults.chat;
    _temperature = defaults.sampling.temperature;
    _topP = defaults.sampling.top_p;
    _topK = defaults.sampling.top_k;
    _seed = defaults.sampling.seed;
  }
  return self;
}

@end

@implementation EMGenerateStats

- (instancetype)initWithStats:(const edgemtp::GenerateStats&)stats {
  if ((self = [super init])) {
    _promptTokens = stats.prompt_tokens;
    _reusedTokens = stats.reused_tokens;
    _generatedTokens = static_cast<NSInteger>(stats.tokens.size());
    NSMutableArray<NSNumber*>* tokens = [NSMutableArray arrayWithCapacity:stats.tokens.size()];
    for (int token : stats.tokens) [tokens addObject:@(token)];
    _tokens = [tokens copy];
    _text = em_ns(stats.text);
    _stopReason = em_ns(stats.stop_reason);
    _ttftSeconds = stats.ttft_s;
    _decodeSeconds = stats.decode_s;
    _prefillTokensPerSecond = stats.prefill_tok_s();
    _decodeTokensPerSecond = stats.decode_tok_s();
    _acceptance = stats.acceptance();
    _rounds = static_cast<NSInteger>(stats.rounds.size());
    for (const auto& [drafted, accepted] : stats.rounds) {
      _drafted += drafted;
      _accepted += accepted;
    }
    NSMutableDictionary<NSString*, NSNumber*>* phases = [NSMutableDictionary dictionary];
    for (const auto& [phase, seconds] : stats.seconds_by_phase) phases[em_ns(phase)] = @(seconds);
    _secondsByPhase = [phases copy];
  }
  return self;
}

@end

@implementation EMBundleInfo

- (instancetype)initWithName:(NSString*)name
                      config:(const edgemtp::BundleConfig&)config
                computeUnits:(NSString*)computeUnits
                hasTokenizer:(BOOL)hasTokenizer {
  if ((self = [super init])) {
    _name = [name copy];
    _backend = em_ns(config.backend);
    _delegate = em_ns(config.delegate);
    _computeUnits = [computeUnits copy];
    _maxContext = config.shapes.max_context;
    _maxDraft = config.has_drafter ? config.shapes.max_draft : 0;
    _hasDrafter = config.has_drafter;
    _hasTokenizer = hasTokenizer;
    _vocabSize = config.vocab_size;
    NSMutableArray<NSString*>* methods = [NSMutableArray array];
    for (const std::string& method : config.methods) [methods addObject:em_ns(method)];
    _methods = [methods copy];
  }
  return self;
}

@end

namespace {

edgemtp::GenerateOptions engine_options(EMGenerateOptions* options, EMStopFlag* stopFlag) {
  edgemtp::GenerateOptions o;
  o.max_new_tokens = static_cast<int>(options.maxNewTokens);
  o.depth = static_cast<int>(options.depth);
  o.chat = options.chat;
  o.sampling.temperature = options.temperature;
  o.sampling.top_p = options.topP;
  o.sampling.top_k = static_cast<int>(options.topK);
  o.sampling.seed = options.seed;
  if (stopFlag != nil) o.should_stop = [stopFlag] { return static_cast<bool>(stopFlag.isStopRequested); };
  return o;
}

}  // namespace

// --- engine -------------------------------------------------------------------------------------

@implementation EMEngine {
  std::unique_ptr<edgemtp::ios::CoreMLRunner> _runner;
  std::unique_ptr<edgemtp::Engine> _engine;
  std::string _bundlePath;
}

- (instancetype)initWithBundleURL:(NSURL*)bundleURL error:(NSError**)error {
  if (!(self = [super init])) return nil;
  try {
    _bundlePath = bundleURL.fileSystemRepresentation;
    NSURL* manifestURL = [bundleURL URLByAppendingPathComponent:@"manifest.json"];
    NSData* data = [NSData dataWithContentsOfURL:manifestURL];
    if (data == nil) {
      throw edgemtp::Error(em_std(bundleURL.lastPathComponent) + " has no readable manifest.json: "
                           "choose an edgemtp export bundle folder (copy the whole folder)");
    }
    const std::string text(static_cast<const char*>(data.bytes), data.length);
    edgemtp::json::Value manifest;
    try {
      manifest = edgemtp::json::Value::parse(text);
    } catch (const edgemtp::json::ParseError& failure) {
      throw edgemtp::Error(std::string("manifest.json is not valid JSON (") + failure.what() +
                           "): export the bundle again");
    }
    auto plan = edgemtp::ios::CoreMLPlan::from_manifest(manifest);
    NSURL* caches = [NSFileManager.defaultManager URLsForDirectory:NSCachesDirectory
                                                         inDomains:NSUserDomainMask].firstObject;
    NSURL* compiled = [caches URLByAppendingPathComponent:@"edgemtp-compiled" isDirectory:YES];
    _runner = std::make_unique<edgemtp::ios::CoreMLRunner>(bundleURL, std::move(plan), compiled,
                                                           edgemtp::sha256_hex(text));
    _engine = std::make_unique<edgemtp::Engine>(_bundlePath, *_runner);
    _bundleInfo = [[EMBundleInfo alloc] initWithName:bundleURL.lastPathComponent
                                              config:_engine->config()
                                        computeUnits:@(compute_units_name(_runner->plan().units))
                                        hasTokenizer:_engine->has_tokenizer()];
  } catch (const edgemtp::ios::SharedStateError& failure) {
    if (error) *error = em_error(EMErrorCodeSharedState, failure);
    return nil;
  } catch (const std::exception& failure) {
    if (error) *error = em_error(EMErrorCodeBundle, failure);
    return nil;
  }
  return self;
}

- (void)dealloc {
  _engine.reset();  // first: it holds a reference to the runner
  _runner.reset();
}

- (edgemtp::Engine&)cppEngine {
  return *_engine;
}

- (std::string)bundlePath {
  return _bundlePath;
}

- (EMGenerateStats*)generateWithPrompt:(NSString*)prompt
                               options:(EMGenerateOptions*)options
                              stopFlag:(EMStopFlag*)stopFlag
                                onText:(void (^)(NSString*))onText
                                 error:(NSError**)error {
  edgemtp::GenerateOptions o = engine_options(options, stopFlag);
  if (onText != nil) {
    o.on_text = [onText](const std::string& text, const std::vector<int>&) {
      @autoreleasepool {
        onText(em_ns(text));
      }
    };
  }
  const std::string text = em_std(prompt);
  return [self stats:error of:[&] { return _engine->generate_text(text, o); }];
}

- (EMGenerateStats*)generateWithTokenIDs:(NSArray<NSNumber*>*)prompt
                                 options:(EMGenerateOptions*)options
                                stopFlag:(EMStopFlag*)stopFlag
                                   error:(NSError**)error {
  const edgemtp::GenerateOptions o = engine_options(options, stopFlag);
  std::vector<int> ids;
  for (NSNumber* token in prompt) ids.push_back(token.intValue);
  return [self stats:error of:[&] { return _engine->generate(ids, o); }];
}

// Runs one generation, turning a C++ exception into `error`.
- (EMGenerateStats*)stats:(NSError**)error of:(const std::function<edgemtp::GenerateStats()>&)generate {
  try {
    return [[EMGenerateStats alloc] initWithStats:generate()];
  } catch (const edgemtp::ios::SharedStateError& failure) {
    if (error) *error = em_error(EMErrorCodeSharedState, failure);
  } catch (const std::exception& failure) {
    if (error) *error = em_error(EMErrorCodeRun, failure);
  }
  return nil;
}

- (void)reset {
  _engine->reset();
}

@end
