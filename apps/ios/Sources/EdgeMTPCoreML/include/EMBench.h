// The core's benchmark mode (apps/core/include/edgemtp/bench.h: run_bench), which writes the
// `edgemtp bench` result JSON (runtime/bench.schema.json) that `edgemtp bench collect` reads.
#import <Foundation/Foundation.h>

#import "EMEngine.h"

NS_ASSUME_NONNULL_BEGIN

/// The plan: prefill tests ppN, decode tests tgN, at each draft depth (0 is autoregressive).
@interface EMBenchPlan : NSObject
@property(nonatomic, copy) NSArray<NSNumber *> *promptLengths;     // pp (128, 512)
@property(nonatomic, copy) NSArray<NSNumber *> *generatedTokens;   // tg (128)
@property(nonatomic, copy) NSArray<NSNumber *> *depths;            // (0, 1, 2, 3)
@property(nonatomic) NSInteger repetitions;                        // timed runs per test (5)
@property(nonatomic) NSInteger decodePromptLength;                 // prompt of the tg tests (64)
@property(nonatomic) uint64_t seed;                                // of the prompts (0)
@end

/// The result's "machine" object.
@interface EMMachineInfo : NSObject
@property(nonatomic, copy) NSString *platform;  // "ios", or "host" on a Mac
@property(nonatomic, copy) NSString *device;    // e.g. the model identifier "iPhone18,1"
@property(nonatomic, copy) NSString *profile;   // a devices/profiles name, or empty
@property(nonatomic, copy) NSString *cpu;
@property(nonatomic) NSInteger cores;
@property(nonatomic) double memoryGiB;
@property(nonatomic, copy) NSString *os;
@property(nonatomic) NSInteger threads;
@property(nonatomic, copy) NSDictionary<NSString *, NSString *> *libraries;
@end

/// One battery reading; a run's "battery" takes source, unit and start from the reading
/// before it and end from the reading after it. `extra` holds other signals read with it
/// (e.g. thermal_state: fair), recorded as "<key>_start" from the reading before the run and
/// "<key>_end" from the one after.
@interface EMBatteryReading : NSObject
- (instancetype)initWithSource:(NSString *)source
                         start:(double)start
                           end:(double)end
                          unit:(NSString *)unit
                         extra:(NSDictionary<NSString *, NSString *> *)extra NS_DESIGNATED_INITIALIZER;
- (instancetype)init NS_UNAVAILABLE;
@property(nonatomic, readonly, copy) NSString *source;
@property(nonatomic, readonly) double start;
@property(nonatomic, readonly) double end;
@property(nonatomic, readonly, copy) NSString *unit;
@property(nonatomic, readonly, copy) NSDictionary<NSString *, NSString *> *extra;
@end

@interface EMEngine (Bench)

/// Runs the plan and returns the result document's JSON. The hooks run on the calling thread:
/// `batteryBefore` / `batteryAfter` around each run (nil: no reading), `progress` before each
/// run. A stop request ends the bench after the current run, keeping the runs so far.
- (nullable NSString *)runBenchWithPlan:(EMBenchPlan *)plan
                                machine:(EMMachineInfo *)machine
                                command:(NSString *)command
                                created:(NSString *)created
                          batteryBefore:(nullable EMBatteryReading *_Nullable (^)(void))batteryBefore
                           batteryAfter:(nullable EMBatteryReading *_Nullable (^)(void))batteryAfter
                               progress:(nullable void (^)(NSInteger done, NSInteger planned,
                                                           NSString *next))progress
                               stopFlag:(nullable EMStopFlag *)stopFlag
                                  error:(NSError **)error
    NS_SWIFT_NAME(runBench(plan:machine:command:created:batteryBefore:batteryAfter:progress:stopFlag:));

@end

NS_ASSUME_NONNULL_END
