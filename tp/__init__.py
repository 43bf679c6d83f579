"""tp: ``parallelize_module`` and the tensor-parallel styles on top of dtensor_lite -- not built yet.

This package is reserved for the tensor-parallel issue; it exports nothing today.
"""
__all__: list[str] = []
