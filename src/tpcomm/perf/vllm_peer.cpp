// Not part of tpcomm: the benchmark's binding to vLLM's CPU shared-memory
// all-reduce (csrc/cpu/shm.cpp), compiled beside that file, unmodified, by
// tpcomm.perf.peers for `tpcomm perf --compare vllm`.  It registers the three
// functions vLLM's own torch_bindings.cpp registers for its CPU communicator,
// with the same schemas, so a rank calls them as vLLM does: through torch.ops.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <string>

int64_t init_shm_manager(const std::string& name, const int64_t group_size,
                         const int64_t rank, const int64_t thread_num);
std::string join_shm_manager(int64_t handle, const std::string& name);
void shm_allreduce(int64_t handle, at::Tensor& data);

TORCH_LIBRARY(tpcomm_vllm_peer, m) {
  m.def("init_shm_manager(str name, int group_size, int rank, int thread_num) -> int",
        &init_shm_manager);
  m.def("join_shm_manager(int handle, str name) -> str", &join_shm_manager);
  m.def("shm_allreduce(int handle, Tensor! data) -> ()");
}

TORCH_LIBRARY_IMPL(tpcomm_vllm_peer, CPU, m) { m.impl("shm_allreduce", &shm_allreduce); }
