"""Page-locking host tensors in place, for the lean layout's buffers and the GPU share's moments: one owner
for cudaHostRegister and its undo, which must come before the memory is freed."""

from __future__ import annotations

import torch


def page_lock(tensor: torch.Tensor) -> bool:
    """Page-lock a host tensor in place (cudaHostRegister: no copy, no extra bytes) so copies to the GPU run
    asynchronously; False where it already was (or is empty). The caller keeps the tensor alive until page_unlock."""
    if tensor.numel() == 0 or tensor.is_pinned():
        return False
    size = tensor.numel() * tensor.element_size()
    code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 0)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister failed ({code}) on {size} bytes")
    return True


def page_unlock(address: int) -> None:
    """Undo page_lock on the tensor at `address`, before its memory is freed."""
    torch.cuda.cudart().cudaHostUnregister(address)
