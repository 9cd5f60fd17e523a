#import "EMBench.h"

#if !__has_feature(objc_arc)
#error "EMBench.mm is written for ARC (SwiftPM and Xcode turn it on for packages)"
#endif

#include <optional>
#include <string>
#include <vector>

#include "CoreMLRunner.h"
#include "edgemtp/bench.h"

#import "EMBridging.h"
#import "EMEngine+Internal.h"

namespace {

NSArray<NSNumber*>* numbers(const std::vector<int>& values) {
  NSMutableArray<NSNumber*>* out = [NSMutableArray arrayWithCapacity:values.size()];
  for (int v : values) [out addObject:@(v)];
  return out;
}

std::vector<int> ints(NSArray<NSNumber*>* values) {
  std::vector<int> out;
  for (NSNumber* v in values) out.push_back(v.intValue);
  return out;
}

std::optional<edgemtp::BatteryReading> reading(EMBatteryReading* r) {
  if (r == nil) return std::nullopt;
  edgemtp::BatteryReading out{em_std(r.source), r.start, r.end, em_std(r.unit), {}};
  for (NSString* key in [r.extra.allKeys sortedArrayUsingSelector:@selector(compare:)]) {
    out.extra.emplace_back(em_std(key), em_std(r.extra[key]));
  }
  return out;
}

}  // namespace

@implementation EMBenchPlan

- (instancetype)init {
  if ((self = [super init])) {
    const edgemtp::BenchPlan defaults;
    _promptLengths = numbers(defaults.pp);
    _generatedTokens = numbers(defaults.tg);
    _depths = numbers(defaults.depths);
    _repetitions = defaults.repeat;
    _decodePromptLength = defaults.tg_prompt;
    _seed = defaults.seed;
  }
  return self;
}

@end

@implementation EMMachineInfo

- (instancetype)init {
  if ((self = [super init])) {
    _platform = @"ios";
    _device = @"";
    _profile = @"";
    _cpu = @"";
    _os = @"";
    _threads = 1;
    _libraries = @{};
  }
  return self;
}

@end

@implementation EMBatteryReading

- (instancetype)initWithSource:(NSString*)source
                         start:(double)start
                           end:(double)end
                          unit:(NSString*)unit
                         extra:(NSDictionary<NSString*, NSString*>*)extra {
  if ((self = [super init])) {
    _source = [source copy];
    _start = start;
    _end = end;
    _unit = [unit copy];
    _extra = [extra copy];
  }
  return self;
}

@end

@implementation EMEngine (Bench)

- (NSString*)runBenchWithPlan:(EMBenchPlan*)plan
                      machine:(EMMachineInfo*)machine
                      command:(NSString*)command
                      created:(NSString*)created
                batteryBefore:(EMBatteryReading* (^)(void))batteryBefore
                 batteryAfter:(EMBatteryReading* (^)(void))batteryAfter
                     progress:(void (^)(NSInteger, NSInteger, NSString*))progress
                     stopFlag:(EMStopFlag*)stopFlag
                        error:(NSError**)error {
  edgemtp::BenchPlan p;
  p.pp = ints(plan.promptLengths);
  p.tg = ints(plan.generatedTokens);
  p.depths = ints(plan.depths);
  p.repeat = static_cast<int>(plan.repetitions);
  p.tg_prompt = static_cast<int>(plan.decodePromptLength);
  p.seed = plan.seed;

  edgemtp::MachineInfo m;
  m.platform = em_std(machine.platform);
  m.device = em_std(machine.device);
  m.profile = em_std(machine.profile);
  m.cpu = em_std(machine.cpu);
  m.cores = static_cast<int>(machine.cores);
  m.memory_gib = machine.memoryGiB;
  m.os = em_std(machine.os);
  m.threads = static_cast<int>(machine.threads);
  for (NSString* library in [machine.libraries.allKeys sortedArrayUsingSelector:@selector(compare:)]) {
    m.libraries.emplace_back(em_std(library), em_std(machine.libraries[library]));
  }

  edgemtp::BenchHooks hooks;
  if (batteryBefore != nil) hooks.battery_before = [batteryBefore] { return reading(batteryBefore()); };
  if (batteryAfter != nil) hooks.battery_after = [batteryAfter] { return reading(batteryAfter()); };
  if (progress != nil) {
    hooks.progress = [progress](int done, int planned, const std::string& next) {
      @autoreleasepool {
        progress(done, planned, em_ns(next));
      }
    };
  }
  if (stopFlag != nil) hooks.should_stop = [stopFlag] { return static_cast<bool>(stopFlag.isStopRequested); };

  try {
    const std::string result = edgemtp::run_bench([self cppEngine], [self bundlePath], p, m,
                                                  em_std(command), em_std(created), hooks);
    return em_ns(result);
  } catch (const edgemtp::ios::SharedStateError& failure) {
    if (error) *error = em_error(EMErrorCodeSharedState, failure);
  } catch (const std::exception& failure) {
    if (error) *error = em_error(EMErrorCodeRun, failure);
  }
  return nil;
}

@end
