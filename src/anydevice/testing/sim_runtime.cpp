// The simulator's files that need no dispatcher, built as one: streams, events and the guard
// (device.cpp), the caching allocator (memory.cpp), pinned memory (pinned.cpp), the race detector
// (races.cpp) and the Python module (module.cpp). See sim_operators.cpp.
#include "device.cpp"
#include "memory.cpp"
#include "pinned.cpp"
#include "races.cpp"
#include "module.cpp"
