"""trellm's CUDA kernels: one C header (``trellm_kernels.h``, the ABI), ``.cu`` sources without torch
headers, an nvcc build cached by content (``build.py``), a cffi ABI-mode binding (``binding.py``),
and the registration of each kernel as the ``"cuda"`` implementation of a ``trellm.ops`` op
(``ops.py``, imported by ``trellm.ops.load_backends()``). ``trellm build-kernels`` builds ahead of time
(``cli.py``). Measurements: ``NOTES.md``.
"""
