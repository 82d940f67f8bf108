# Types of serving/kserve/_tensors.pyx (strict JSON tensor data) as Python sees it;
# serving/kserve/_tensors_py.py is its pure-Python twin with the same API.
import numpy as np

# What a tensor's JSON elements must be (serving/kserve/_tensors.pxd's Kind).
BOOL: int
INT: int
UINT: int
FLOAT: int

class TensorDataError(ValueError): ...

def decode(
    data: object,
    shape: tuple[int, ...],
    kind: int,
    low: int = 0,
    high: int = 0,
    fmax: float = ...,
) -> np.ndarray: ...
