"""Sharding rules, one module per op family. Importing this package registers them all."""
from . import _registry  # noqa: F401
from . import pointwise, matrix, reduction, tensor_ops, indexing, view  # noqa: F401
from . import batched  # noqa: F401  (before random: its linalg_qr stand-in yields to ours)
from . import random, foreach  # noqa: F401
from . import nn  # noqa: F401
from . import batch_norm  # noqa: F401
from . import fft  # noqa: F401
from . import loss  # noqa: F401
from . import attention  # noqa: F401
from . import view_copy  # noqa: F401  (last: it mirrors the view rules registered above)
