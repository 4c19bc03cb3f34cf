// Kernel threads. Kernels split work over an OpenMP thread pool; BLAS keeps its
// own pool. set_num_threads sets both, so one knob avoids oversubscription
// (e.g. 4 ranks on 2 cores want 1 thread each).
#pragma once

namespace tessera {

int num_threads();
void set_num_threads(int n);

}  // namespace tessera
