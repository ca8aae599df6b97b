"""Weight quantization: the packed format (qweight), checkpoint conversions (convert), the public
ops and their torch references (ops), Triton kernels (triton_kernels, imported only on the Triton
path), kernel settings as data (configs, tune), quantized-folder loading and the quantized expert
backend (load), and rtn.py's fake-quantize reference (the kernel benchmark is
harness/bench/kernels.py). Importing this package imports nothing."""
