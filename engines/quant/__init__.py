"""Weight quantization: the packed format (qweight), checkpoint conversions (convert), the public
ops and their torch references (ops), Triton kernels (triton_kernels, imported only on the Triton
path), kernel settings as data (configs, tune), a GPU benchmark (bench), and rtn.py's
fake-quantize reference. Importing this package imports nothing."""
