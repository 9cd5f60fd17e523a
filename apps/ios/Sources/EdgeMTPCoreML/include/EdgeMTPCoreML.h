// The module's umbrella header (SwiftPM builds the module map from it): Swift sees only these
// Objective-C declarations, never the C++ behind them.
#import "EMEngine.h"
#import "EMBench.h"
