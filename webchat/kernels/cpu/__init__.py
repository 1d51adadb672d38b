"""The C++ CPU kernels: quantized matmuls and the whole forward as one call, built once with torch's loader."""
