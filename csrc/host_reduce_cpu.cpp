// The meeting point of the host all-reduce (mcore_rl/parallel/host_reduce.py): the CPU ranks of one
// data-parallel group on one host sum their gradients through a shared mapping, and between the phases of
// that sum each rank waits here for the others. One counter per rank, each on its own 64-byte line so that
// ranks publishing at once do not invalidate each other's line: a rank stores the barrier's generation with
// release order (what it wrote to the mapping before is then visible) and waits until every counter holds
// that generation, read with acquire order.
//
// Waiting spins briefly (the peer is usually a few microseconds behind on its own core), then yields, then
// sleeps, so a rank that arrives early does not take a core a late peer on the same core needs. Every few
// milliseconds of waiting it asks whether the awaited peer's process still runs: a rank that died must end
// the wait with an error naming it, as gloo's closed connection would, not hang the survivors. A rank that
// lives on but failed (an exception in its loss, say) never arrives either: its failure guard writes its
// rank + 1 into the mapping's abort word (mcore_rl/parallel/failure.py severs its gloo connections at the same
// moment), and every rank waiting here stops with an error naming it.
#include <Python.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <cstdint>
#include <sched.h>
#include <signal.h>
#include <time.h>

#include <vector>

namespace {

constexpr int64_t kLineWords = 8;  // 64-byte lines of int64 counters
constexpr int kSpins = 2000;       // ~ tens of microseconds of pause instructions before yielding
constexpr int kYields = 200;
constexpr long kSleepNs = 20000;   // then 20 us naps
constexpr double kLivenessCheckS = 0.005;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Gone: no such process, or one that has exited and waits to be reaped (a zombie: kill() still finds it,
// and a rank's parent, Ray's raylet or torchrun's agent, may take seconds to reap it).
bool process_gone(long pid) {
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    return true;
  }
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
  std::FILE* file = std::fopen(path, "r");
  if (file == nullptr) {
    return false;  // no procfs to ask: kill() said it exists
  }
  char line[512];
  size_t length = std::fread(line, 1, sizeof(line) - 1, file);
  std::fclose(file);
  line[length] = '\0';
  const char* name_end = std::strrchr(line, ')');  // "pid (comm) state ...": comm may hold spaces or ')'
  return name_end != nullptr && name_end[1] == ' ' && (name_end[2] == 'Z' || name_end[2] == 'X');
}

struct Outcome {
  long gone = -1;       // the rank whose process exited while awaited
  long timed_out = -1;  // the rank still awaited when the timeout passed
  long aborted = -1;    // the rank that stopped the group's reductions (its abort word)
};

// Waits until counters[r * kLineWords] >= generation for every r, at most timeout_s in all (0: no limit), or
// until the abort word is set.
Outcome wait_for_all(int64_t* counters, const int64_t* abort_word, long world, int64_t generation,
                     const long* pids, double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (long r = 0; r < world; ++r) {
    int64_t* counter = counters + r * kLineWords;
    long rounds = 0;
    auto last_check = clock::now();
    while (__atomic_load_n(counter, __ATOMIC_ACQUIRE) < generation) {
      int64_t aborter = __atomic_load_n(abort_word, __ATOMIC_RELAXED);
      if (aborter > 0) {
        return Outcome{-1, -1, static_cast<long>(aborter - 1)};
      }
      ++rounds;
      if (rounds < kSpins) {
        cpu_relax();
        continue;
      }
      if (rounds < kSpins + kYields) {
        sched_yield();
        continue;
      }
      timespec nap{0, kSleepNs};
      nanosleep(&nap, nullptr);
      auto now = clock::now();
      if (std::chrono::duration<double>(now - last_check).count() >= kLivenessCheckS) {
        if (process_gone(pids[r])) {
          return Outcome{r, -1};
        }
        if (timeout_s > 0 && std::chrono::duration<double>(now - start).count() > timeout_s) {
          return Outcome{-1, r};
        }
        last_check = now;
      }
    }
  }
  return Outcome{};
}

}  // namespace

// _C.host_barrier(counters_address, abort_address, rank, world, generation, pids, timeout_s): publishes this
// rank's arrival at barrier `generation` and waits for the group's other ranks, the GIL released.
// counters_address is the shared mapping's counter block (world lines of 64 bytes, 64-byte aligned);
// abort_address its abort word (int64, 0 while the group runs); pids the group's process ids in rank order.
// Raises RuntimeError naming the rank when an awaited peer's process no longer runs, when a rank set the
// abort word, or when a peer has not arrived within timeout_s seconds (0: no limit; the world's collective
// timeout, as gloo's).
PyObject* mcore_rl_host_barrier(PyObject* /*self*/, PyObject* args) {
  unsigned long long address = 0, abort_address = 0;
  long rank = 0, world = 0;
  long long generation = 0;
  PyObject* pid_seq = nullptr;
  double timeout_s = 0;
  if (!PyArg_ParseTuple(args, "KKllLOd", &address, &abort_address, &rank, &world, &generation, &pid_seq,
                        &timeout_s)) {
    return nullptr;
  }
  if (address == 0 || address % 64 != 0 || abort_address == 0 || abort_address % 8 != 0 || world < 1 ||
      rank < 0 || rank >= world || generation < 1) {
    PyErr_SetString(PyExc_ValueError, "host_barrier: bad counters or abort address, rank, world or generation");
    return nullptr;
  }
  PyObject* pid_list = PySequence_Fast(pid_seq, "host_barrier: pids must be a sequence");
  if (pid_list == nullptr) {
    return nullptr;
  }
  if (PySequence_Fast_GET_SIZE(pid_list) != world) {
    Py_DECREF(pid_list);
    PyErr_SetString(PyExc_ValueError, "host_barrier: one pid per rank is needed");
    return nullptr;
  }
  std::vector<long> pids(static_cast<size_t>(world));
  for (long r = 0; r < world; ++r) {
    pids[r] = PyLong_AsLong(PySequence_Fast_GET_ITEM(pid_list, r));
  }
  Py_DECREF(pid_list);
  if (PyErr_Occurred()) {
    return nullptr;
  }
  auto* counters = reinterpret_cast<int64_t*>(static_cast<uintptr_t>(address));
  const auto* abort_word = reinterpret_cast<const int64_t*>(static_cast<uintptr_t>(abort_address));
  Outcome outcome;
  Py_BEGIN_ALLOW_THREADS;
  __atomic_store_n(counters + rank * kLineWords, static_cast<int64_t>(generation), __ATOMIC_RELEASE);
  outcome = wait_for_all(counters, abort_word, world, generation, pids.data(), timeout_s);
  Py_END_ALLOW_THREADS;
  if (outcome.aborted >= 0) {
    PyErr_Format(PyExc_RuntimeError,
                 "host all-reduce: rank %ld of the group stopped its reductions (it failed) while rank %ld "
                 "waited for it",
                 outcome.aborted, rank);
    return nullptr;
  }
  if (outcome.gone >= 0) {
    PyErr_Format(PyExc_RuntimeError,
                 "host all-reduce: rank %ld of the data-parallel group (pid %ld) exited while rank %ld waited "
                 "for it",
                 outcome.gone, pids[outcome.gone], rank);
    return nullptr;
  }
  if (outcome.timed_out >= 0) {
    char seconds[32];  // PyErr_Format has no %g
    std::snprintf(seconds, sizeof(seconds), "%g", timeout_s);
    PyErr_Format(PyExc_RuntimeError,
                 "host all-reduce: rank %ld of the data-parallel group (pid %ld) did not arrive within %s s",
                 outcome.timed_out, pids[outcome.timed_out], seconds);
    return nullptr;
  }
  Py_RETURN_NONE;
}
