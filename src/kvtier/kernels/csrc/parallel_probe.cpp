// How many threads at::parallel_for runs a kernel's tasks on, built with the flags of every kernel
// (kvtier/kernels/build.py): 1 means the kernels run serially whatever torch.set_num_threads says.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <chrono>
#include <thread>

int64_t parallel_threads(int64_t tasks) {
  std::vector<std::atomic<int>> seen(at::get_num_threads());
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t id = at::get_thread_num();
      if (id >= 0 && id < static_cast<int64_t>(seen.size())) seen[id].store(1);
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // every thread gets a task
    }
  });
  int64_t n = 0;
  for (auto& s : seen) n += s.load();
  return n;
}
