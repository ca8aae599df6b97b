"""Small helpers the harness may import: sizes, device and dtype names, the tokenizer loader,
model-folder detection, the bundled demo model's path and pwbench hw's peaks cache. Only
device.py imports torch (it resolves torch devices); the others stay light."""
