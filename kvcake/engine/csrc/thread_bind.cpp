// Binds each thread of torch's intra-op pool, as the calling thread sees it, to one CPU.
//
// vLLM's CPU launcher pins its worker's OpenMP threads one per core; unbound, the kernel may run
// two of a step's threads on one core for a while (every parallel region then waits for the
// slower one). at::parallel_for over [0, n) with grain 1 gives chunk i to pool thread i (the
// caller is thread 0), so each thread pins itself to cpus[i] inside one parallel region; the
// pool keeps the same threads for later regions of the same caller and thread count.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace {

// Per pool thread: the CPU it is now bound to, or -1 when binding it failed (or the pool had
// fewer threads than CPUs given).
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n >= 1, "bind_threads: give at least one CPU");
  TORCH_CHECK(n == at::get_num_threads(),
              "bind_threads: one CPU per intra-op thread: ", at::get_num_threads(),
              " threads, ", n, " CPUs given");
  std::vector<int64_t> bound(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      if (sched_setaffinity(static_cast<pid_t>(syscall(SYS_gettid)), sizeof(set), &set) == 0)
        bound[i] = cpus[i];
    }
  });
  return bound;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcake, m) { m.def("bind_threads(int[] cpus) -> int[]", &bind_threads); }
