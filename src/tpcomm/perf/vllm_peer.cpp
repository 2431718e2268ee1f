// Not part of tpcomm: the benchmark's binding to vLLM's CPU shared-memory
// all-reduce (csrc/cpu/shm.cpp), compiled beside that file, unmodified, by
// tpcomm.perf.peers for `tpcomm perf --compare vllm,vllm_kernel`.  It
// registers the three functions vLLM's own torch_bindings.cpp registers for
// its CPU communicator, with the same schemas, so a rank calls them as vLLM
// does: through torch.ops (`vllm`).  It is also a Python module whose one
// function calls the same kernel with the thinnest call there is (`vllm_kernel`:
// no dispatcher, the tensor unpacked in place), so that a comparison can
// show the kernel apart from the cost of vLLM's way of calling it.
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <exception>
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

// shm_allreduce(handle, tensor): the kernel, called from Python directly
static PyObject* bare_allreduce(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !THPVariable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "shm_allreduce(handle, tensor)");
    return nullptr;
  }
  const int64_t handle = PyLong_AsLongLong(args[0]);
  if (handle == -1 && PyErr_Occurred()) return nullptr;
  at::Tensor t = THPVariable_Unpack(args[1]);
  try {
    shm_allreduce(handle, t);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"shm_allreduce", (PyCFunction)(void (*)(void))bare_allreduce, METH_FASTCALL,
     "shm_allreduce(handle, tensor): vLLM's kernel, no dispatcher"},
    {nullptr, nullptr, 0, nullptr}};

static PyModuleDef module = {PyModuleDef_HEAD_INIT, "tpcomm_vllm_peer", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_tpcomm_vllm_peer(void) { return PyModule_Create(&module); }
