// An Objective-C face of the C++ core's Engine (apps/core/include/edgemtp/engine.h) running a
// Core ML bundle. Plain Objective-C, so Swift imports it without C++ interoperability; every
// C++ exception becomes an NSError. Calls block: make them off the main thread, one at a time.
#import <Foundation/Foundation.h>

NS_ASSUME_NONNULL_BEGIN

FOUNDATION_EXPORT NSErrorDomain const EMErrorDomain;

typedef NS_ERROR_ENUM(EMErrorDomain, EMErrorCode) {
  /// The bundle cannot be opened: a missing file, a manifest the core refuses, a bundle of
  /// another backend, a package Core ML cannot compile or load.
  EMErrorCodeBundle = 1,
  /// A generation or a benchmark failed.
  EMErrorCodeRun = 2,
  /// Core ML would not let the package's functions share one MLState (the K/V cache that the
  /// target writes and the drafter reads). export/coreml.py leaves this unverified off-device.
  EMErrorCodeSharedState = 3,
};

/// Asks a running generation or benchmark to stop at its next round; safe from any thread.
NS_SWIFT_SENDABLE
@interface EMStopFlag : NSObject
- (void)requestStop;
@property(readonly, getter=isStopRequested) BOOL stopRequested;
@end

@interface EMGenerateOptions : NSObject
@property(nonatomic) NSInteger maxNewTokens;  // committed tokens, the first included (128)
@property(nonatomic) NSInteger depth;         // -1 adaptive (default), 0 autoregressive, k pinned
@property(nonatomic) BOOL chat;               // wrap the prompt in the tokenizer's turn markers
@property(nonatomic) double temperature;      // 0: greedy (default)
@property(nonatomic) double topP;             // 1: off
@property(nonatomic) NSInteger topK;          // 0: off
@property(nonatomic) uint64_t seed;
@end

/// One generation's measurements (the core's GenerateStats).
@interface EMGenerateStats : NSObject
@property(nonatomic, readonly) NSInteger promptTokens;
@property(nonatomic, readonly) NSInteger reusedTokens;
@property(nonatomic, readonly) NSInteger generatedTokens;
@property(nonatomic, readonly, copy) NSArray<NSNumber *> *tokens;  // committed ids, the first included
@property(nonatomic, readonly, copy) NSString *text;
@property(nonatomic, readonly, copy) NSString *stopReason;  // stop, length, context, interrupted
@property(nonatomic, readonly) double ttftSeconds;
@property(nonatomic, readonly) double decodeSeconds;
@property(nonatomic, readonly) double prefillTokensPerSecond;
@property(nonatomic, readonly) double decodeTokensPerSecond;  // (tokens - 1) / decode time
@property(nonatomic, readonly) double acceptance;             // accepted / drafted; 0 without drafts
@property(nonatomic, readonly) NSInteger rounds;
@property(nonatomic, readonly) NSInteger drafted;
@property(nonatomic, readonly) NSInteger accepted;
@property(nonatomic, readonly, copy) NSDictionary<NSString *, NSNumber *> *secondsByPhase;
@end

/// What the opened bundle is, as its manifest says.
@interface EMBundleInfo : NSObject
@property(nonatomic, readonly, copy) NSString *name;  // the bundle folder's name
@property(nonatomic, readonly, copy) NSString *backend;
@property(nonatomic, readonly, copy) NSString *delegate;
@property(nonatomic, readonly, copy) NSString *computeUnits;  // e.g. CPU_AND_NE
@property(nonatomic, readonly) NSInteger maxContext;
@property(nonatomic, readonly) NSInteger maxDraft;
@property(nonatomic, readonly) BOOL hasDrafter;
@property(nonatomic, readonly) BOOL hasTokenizer;
@property(nonatomic, readonly) NSInteger vocabSize;
@property(nonatomic, readonly, copy) NSArray<NSString *> *methods;
@end

@interface EMEngine : NSObject

/// Opens a bundle folder: reads its manifest, compiles its Core ML package the first time
/// (kept in the app's caches, keyed by the manifest's SHA-256), loads one MLModel per function
/// with the delegate's compute units and makes the one MLState they share.
- (nullable instancetype)initWithBundleURL:(NSURL *)bundleURL
                                     error:(NSError **)error NS_DESIGNATED_INITIALIZER;
- (instancetype)init NS_UNAVAILABLE;

@property(nonatomic, readonly) EMBundleInfo *bundleInfo;

/// Generates after `prompt`. `onText` receives each newly completed piece of text, on the
/// calling thread, as it is committed.
- (nullable EMGenerateStats *)generateWithPrompt:(NSString *)prompt
                                         options:(EMGenerateOptions *)options
                                        stopFlag:(nullable EMStopFlag *)stopFlag
                                          onText:(nullable void (^)(NSString *text))onText
                                           error:(NSError **)error
    NS_SWIFT_NAME(generate(prompt:options:stopFlag:onText:));

/// The same after token ids (a bundle without tokenizer.json takes only these); `onText` is
/// then not called.
- (nullable EMGenerateStats *)generateWithTokenIDs:(NSArray<NSNumber *> *)prompt
                                           options:(EMGenerateOptions *)options
                                          stopFlag:(nullable EMStopFlag *)stopFlag
                                             error:(NSError **)error
    NS_SWIFT_NAME(generate(tokenIDs:options:stopFlag:));

/// Forgets the cache: the next prompt is prefilled from position 0.
- (void)reset;

@end

NS_ASSUME_NONNULL_END
