// The suffix index of the auto planner's drafts (qsuffix.cpp), bound into the module by qops.cpp.
#pragma once
#include <torch/extension.h>

namespace wq {
void bind_suffix(pybind11::module_& m);
}  // namespace wq
