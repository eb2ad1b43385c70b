// The simulator's files that need torch's dispatcher (its headers are the heaviest to
// compile), built as one: the operators (kernels.cpp, with the fused recurrent cells of
// recurrent_cells.cpp) and the race detector's operator hook (watch.cpp). sim_runtime.cpp
// holds the rest; the two build in parallel.
#include "recurrent_cells.cpp"
#include "kernels.cpp"
#include "watch.cpp"
