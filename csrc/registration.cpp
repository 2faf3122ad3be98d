// The schemas of every mcore_rl op, declared once. Kernels register against them in their own files:
// csrc/*_cpu.cpp for CPU, csrc/cuda/ops_bindings.cpp for CUDA (CUDA builds only). The Python wrappers,
// fake (meta) kernels, autograd formulas and pure-PyTorch references live in mcore_rl/ops/.
#include <Python.h>
#include <torch/library.h>

#ifndef MCORE_RL_WITH_CUDA
#define MCORE_RL_WITH_CUDA 0
#endif

// The host cache's two functions (csrc/host_cache_cpu.cpp): plain module functions, not ops, since they
// take no tensors and change the process's CPU allocator.
PyObject* mcore_rl_host_cache_configure(PyObject* self, PyObject* args);
PyObject* mcore_rl_host_cache_stats(PyObject* self, PyObject* args);
// The host all-reduce's barrier (csrc/host_reduce_cpu.cpp): a module function, it waits with the GIL released.
PyObject* mcore_rl_host_barrier(PyObject* self, PyObject* args);

extern "C" {
// `import mcore_rl._C` loads this library, which runs the static registrations below. The module itself
// tells Python whether CUDA kernels were compiled in and holds the host cache's and host barrier's functions.
PyObject* PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"host_cache_configure", mcore_rl_host_cache_configure, METH_VARARGS,
       "host_cache_configure(max_cached_bytes, min_block_bytes): torch's CPU allocator keeps freed blocks"},
      {"host_cache_stats", mcore_rl_host_cache_stats, METH_NOARGS, "host_cache_stats() -> dict of counters"},
      {"host_barrier", mcore_rl_host_barrier, METH_VARARGS,
       "host_barrier(counters_address, abort_address, rank, world, generation, pids, timeout_s): meet the "
       "host group's ranks"},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddIntConstant(module, "WITH_CUDA", MCORE_RL_WITH_CUDA) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(mcore_rl, m) {
  // Per-row statistics of softmax(logits / T) over this vocab shard, in fp32: [N, 4] =
  // (max z, sum exp(z - max), sum exp(z - max) * (z - max), z of the target if this shard holds it else 0),
  // with z = logits * inv_temperature and columns whose global id is >= vocab_size left out.
  m.def(
      "logprob_stats(Tensor logits, Tensor targets, int vocab_start, int vocab_size, "
      "float inv_temperature) -> Tensor");
  // grad_logits = d(g1 . logprob + g2 . entropy) / d logits, from the all-reduced softmax_stats
  // [N, 2] = (logsumexp z, entropy); written into grad_logits (same shape and dtype as logits).
  m.def(
      "logprob_entropy_backward(Tensor grad_logprob, Tensor grad_entropy, Tensor logits, Tensor targets, "
      "Tensor softmax_stats, int vocab_start, int vocab_size, float inv_temperature, "
      "Tensor(a!) grad_logits) -> ()");
  // Block copies listed in table [K, 7] (see mcore_rl/ops/pack.py) from sources into the flat `out`,
  // casting to out's dtype; unpack_copy runs the same table backwards.
  m.def("pack_copy(Tensor[] sources, Tensor table, Tensor(a!) out) -> ()");
  m.def("unpack_copy(Tensor packed, Tensor table, Tensor(a!)[] outs) -> ()");
  // One decode step of the rollout engine's attention (see mcore_rl/ops/decode.py): rotary on the new token's
  // query and key heads, its key and value written into cache column `column`, then grouped-query attention
  // of each row over cache columns [start[row], column]. CPU only.
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, int column, "
      "Tensor? start, int num_heads, float scale) -> Tensor");
  // The decode step's pointwise blocks, one pass each (CPU only): x * rsqrt(mean(x^2) + eps) * weight per
  // row, and silu(gate) * up of a fused [rows, 2f] = [gate | up] projection.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  // add + x @ W for a few rows of x [M, K], W [K, N] packed as column panels [ceil(N / 16), K, 16] (see
  // mcore_rl/ops/decode.py), add None, [N] or [M, N] (CPU only).
  m.def("decode_linear(Tensor x, Tensor panels, int n, Tensor? add) -> Tensor");
}
