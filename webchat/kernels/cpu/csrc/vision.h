// The vision encoder's forward (vision.cpp), bound into the module by qops.cpp.
#pragma once
#include <torch/extension.h>

namespace wq {
void bind_vision(pybind11::module_& m);
}  // namespace wq
