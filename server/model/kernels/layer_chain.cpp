// A decode step's layer graphs called one after another from C++ (model/layer_chain.py).
//
// Why: between two layer graphs of a step the Python side does the same things every step
// (look up the layer's graph and modules, fill the learned call's inputs, convert a list
// of tensors into handles and back).  That took ~25 us a layer on warm caches and ~95 us
// in a served step, where each layer's products have just pushed tens of megabytes
// through the caches: ~1 ms of a 17 ms batch-1 step of the 0.5b model on 2 Zen 4 cores.
//
// A chain holds, per layer, the entry point of the graph's C++ wrapper (Inductor's
// ``inductor_entry_impl``: input handles in, which it takes over, output handles out,
// which the caller takes over), the inputs that never change (weights, numbers) and where
// each other input comes from: the running hidden state (the previous layer's output), one
// of the window's tensors, the layer's cache, or one size of those.  Numbers reach the
// wrapper as 0-d int64 tensors, as Inductor's own Python shim hands them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

extern "C" {
// The wrapper releases the GIL around its kernels (PyEval_SaveThread): it must be called
// holding it, while torch's Python binding of an operator calls it without.  Resolved in
// the Python process that loads this library.
int PyGILState_Ensure(void);
void PyGILState_Release(int);
}

namespace {

using entry_fn = void (*)(void** inputs, void** outputs);

// Where one input of a layer's wrapper comes from.
enum Source : int64_t { kConstant = 0, kHidden = 1, kWindow = 2, kCache = 3 };

struct Input {
  int64_t source;
  int64_t index;     // kConstant: into the layer's constants; kWindow / kCache: which tensor
  int64_t dim;       // -1: the tensor; else that size of it, as a 0-d int64 tensor
};

struct Layer {
  entry_fn entry = nullptr;
  int64_t outputs = 0;
  int64_t pick = 0;            // the output that is the next layer's hidden state
  bool windowed = false;       // the hidden state enters as [sequences, window, H]
  int64_t cache_first = 0;     // the layer's cache tensors start there in the caches given
  std::vector<Input> inputs;
  std::vector<at::Tensor> constants;
};

struct Chain {
  std::vector<Layer> layers;
};

std::mutex chains_lock;
std::unordered_map<int64_t, std::shared_ptr<Chain>> chains;
int64_t next_chain = 1;

std::shared_ptr<Chain> find(int64_t id) {
  std::lock_guard<std::mutex> hold(chains_lock);
  auto it = chains.find(id);
  TORCH_CHECK(it != chains.end(), "mtp_native::chain: no chain ", id);
  return it->second;
}

// A size as the wrapper reads it; made once per value (the wrapper only reads it).
const at::Tensor& size_tensor(int64_t value) {
  thread_local std::unordered_map<int64_t, at::Tensor> made;
  auto it = made.find(value);
  if (it != made.end()) return it->second;
  if (made.size() > 4096) made.clear();
  return made.emplace(value, at::scalar_tensor(value, at::TensorOptions().dtype(at::kLong))).first->second;
}

// Adds a layer to chain ``chain`` (0: a new chain); returns the chain's id.  ``spec``:
// (source, index, dim) per input, flat.
int64_t chain_add(int64_t chain, int64_t entry, int64_t outputs, int64_t pick, bool windowed,
                  int64_t cache_first, std::vector<int64_t> spec, std::vector<at::Tensor> constants) {
  TORCH_CHECK(entry != 0, "mtp_native::chain_add: no entry point");
  TORCH_CHECK(spec.size() % 3 == 0, "mtp_native::chain_add: spec is (source, index, dim) per input");
  TORCH_CHECK(pick >= 0 && pick < outputs, "mtp_native::chain_add: output ", pick, " of ", outputs);
  Layer layer;
  layer.entry = reinterpret_cast<entry_fn>(entry);
  layer.outputs = outputs;
  layer.pick = pick;
  layer.windowed = windowed;
  layer.cache_first = cache_first;
  for (size_t i = 0; i < spec.size(); i += 3) {
    Input in{spec[i], spec[i + 1], spec[i + 2]};
    TORCH_CHECK(in.source >= kConstant && in.source <= kCache, "mtp_native::chain_add: source ", in.source);
    TORCH_CHECK(in.source != kConstant || (in.index >= 0 && in.index < (int64_t)constants.size()),
                "mtp_native::chain_add: constant ", in.index, " of ", constants.size());
    TORCH_CHECK(in.source != kConstant || in.dim == -1, "mtp_native::chain_add: a constant's size");
    layer.inputs.push_back(in);
  }
  layer.constants = std::move(constants);
  std::lock_guard<std::mutex> hold(chains_lock);
  if (chain == 0) {
    chain = next_chain++;
    chains[chain] = std::make_shared<Chain>();
  }
  auto it = chains.find(chain);
  TORCH_CHECK(it != chains.end(), "mtp_native::chain_add: no chain ", chain);
  it->second->layers.push_back(std::move(layer));
  return chain;
}

void chain_drop(int64_t chain) {
  std::lock_guard<std::mutex> hold(chains_lock);
  chains.erase(chain);
}

const at::Tensor& pick_tensor(at::TensorList from, int64_t index, const char* what) {
  TORCH_CHECK(index >= 0 && index < (int64_t)from.size(), "mtp_native::chain_run: ", what, " ", index,
              " of ", from.size());
  return from[index];
}

// The hidden state x through every layer of the chain; returns the last layer's output.
at::Tensor chain_run(int64_t id, const at::Tensor& start, at::TensorList window, at::TensorList caches) {
  std::shared_ptr<Chain> chain = find(id);
  at::Tensor x = start;
  std::vector<const at::Tensor*> given;
  std::vector<void*> in_handles, out_handles;
  int gil = PyGILState_Ensure();
  try {
    for (const Layer& layer : chain->layers) {
      at::Tensor hidden = x;
      if (layer.windowed) {
        TORCH_CHECK(!window.empty(), "mtp_native::chain_run: a windowed layer without its window");
        hidden = x.view({window[0].size(0), -1, x.size(-1)});
      }
      given.clear();
      for (const Input& in : layer.inputs) {
        const at::Tensor* t;
        switch (in.source) {
          case kConstant: t = &layer.constants[in.index]; break;
          case kHidden: t = &hidden; break;
          case kWindow: t = &pick_tensor(window, in.index, "window tensor"); break;
          default: t = &pick_tensor(caches, layer.cache_first + in.index, "cache tensor"); break;
        }
        if (in.dim >= 0) {
          TORCH_CHECK(in.dim < t->dim(), "mtp_native::chain_run: size ", in.dim, " of a ", t->dim(), "-d tensor");
          t = &size_tensor(t->size(in.dim));
        }
        given.push_back(t);
      }
      // Every input found before any handle is made: a failed check leaks none.
      in_handles.clear();
      for (const at::Tensor* t : given) in_handles.push_back(new at::Tensor(*t));
      out_handles.assign(layer.outputs, nullptr);
      // The wrapper takes over the input handles (also when it throws).
      layer.entry(in_handles.data(), out_handles.data());
      for (int64_t o = 0; o < layer.outputs; o++) {
        auto* held = reinterpret_cast<at::Tensor*>(out_handles[o]);
        if (o == layer.pick) x = std::move(*held);
        delete held;
      }
    }
  } catch (...) {
    PyGILState_Release(gil);
    throw;
  }
  PyGILState_Release(gil);
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtp_native, m) {
  m.def("chain_add(int chain, int entry, int outputs, int pick, bool windowed, int cache_first, int[] spec, "
        "Tensor[] constants) -> int", &chain_add);
  m.def("chain_drop(int chain) -> ()", &chain_drop);
  m.def("chain_run(int chain, Tensor x, Tensor[] window, Tensor[] caches) -> Tensor", &chain_run);
}
