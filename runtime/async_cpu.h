// The asynchronous CPU test device's streams and events (runtime/stream.h
// says what the device is for). Internal to runtime/.
#pragma once

#include "runtime/stream.h"

namespace tessera::async_cpu {

Stream& default_stream();
StreamPtr new_stream();
std::shared_ptr<Event> make_event();
void synchronize_all();  // every live stream of the device
void set_delays(int max_us);
int delays();

}  // namespace tessera::async_cpu
