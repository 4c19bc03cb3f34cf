// Kernel threads. Kernels split work over an OpenMP thread pool; BLAS keeps its
// own pool. set_num_threads sets both, so one knob avoids oversubscription
// (e.g. 4 ranks on 2 cores want 1 thread each).
#pragma once

#include <vector>

namespace tessera {

int num_threads();
void set_num_threads(int n);

// Where threads run (Linux; elsewhere allowed_cpus() is empty and pinning
// does nothing).
// The CPUs this process may run on now (its affinity mask), ascending.
std::vector<int> allowed_cpus();
// Keeps every thread of this process, and every thread started later, to
// `cpus`: any of those it was started with (the launcher's binding, else all
// CPUs), so a mask narrowed here can be widened again. Throws, naming the
// CPU, for one outside them or for none.
void pin_process_to(const std::vector<int>& cpus);
// Keeps the calling thread, and the threads it starts later, to `cpus`.
void pin_thread_to(const std::vector<int>& cpus);

}  // namespace tessera
