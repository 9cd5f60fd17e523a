// What EMEngine's categories (EMBench.mm) reach behind its Objective-C interface.
#pragma once

#include <string>

#include "edgemtp/engine.h"

#import "EMEngine.h"

@interface EMEngine ()
- (edgemtp::Engine&)cppEngine;
- (std::string)bundlePath;
@end
