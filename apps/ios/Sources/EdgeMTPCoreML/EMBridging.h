// Strings and errors across the Objective-C / C++ line (Objective-C++ only).
#pragma once

#import <Foundation/Foundation.h>

#include <exception>
#include <string>

#import "EMEngine.h"

inline NSString* em_ns(const std::string& text) {
  NSString* s = [[NSString alloc] initWithBytes:text.data()
                                         length:text.size()
                                       encoding:NSUTF8StringEncoding];
  // The core sends whole UTF-8 characters; anything else is shown as Latin-1, not dropped.
  return s ?: [[NSString alloc] initWithBytes:text.data()
                                       length:text.size()
                                     encoding:NSISOLatin1StringEncoding];
}

inline std::string em_std(NSString* text) {
  return text == nil ? std::string() : std::string(text.UTF8String);
}

inline NSError* em_error(EMErrorCode code, const std::exception& failure) {
  return [NSError errorWithDomain:EMErrorDomain
                             code:code
                         userInfo:@{NSLocalizedDescriptionKey : em_ns(failure.what())}];
}
