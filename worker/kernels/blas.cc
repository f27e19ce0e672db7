#include "worker/kernels/blas.h"

#include <cblas.h>

namespace tessera {

std::string blas_kernel_name() {
  const char* name = openblas_get_corename();
  return name == nullptr ? std::string() : std::string(name);
}

bool cpu_supports_avx512() { return __builtin_cpu_supports("avx512f"); }

}  // namespace tessera
