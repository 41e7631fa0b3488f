"""ferry: move model weights from RL trainer ranks to inference ranks.

Inference side (this module today):

    import ferry, torch
    with ferry.record() as plan:            # record a torch-style loader
        my_loader(params={n: ferry.param(n, shape, dtype) ...},
                  weights={n: ferry.source(n, shape, dtype) ...})
    plan.replay(checkpoint_tensors, model_params)   # zero-copy, in place

    plan = ferry.record_load(module, {name: (shape, dtype), ...})  # a torch module's own load_weights

See docs/python.md.
"""
from . import _ferry
from . import errors
from .errors import *  # noqa: F401,F403 - the exception classes are part of the API
from ._tensor import Tensor, source, param, dtype_name
from ._plan import Plan, TensorDecl, record
from ._record_load import record_load

_ferry._set_error_classes(errors._classes())

__version__ = _ferry.__version__  # the CMake project version the extension was built from

__all__ = ["Tensor", "source", "param", "dtype_name", "Plan", "TensorDecl", "record", "record_load", "errors"] + errors.__all__

if hasattr(_ferry, "_ModelLoader"):  # built with the models module
    from ._models import ModelLoader, supported_architectures  # noqa: F401
    __all__ += ["ModelLoader", "supported_architectures"]

if hasattr(_ferry, "_Producer"):  # built with the engine
    from ._engine import (WeightSource, Producer, Consumer, StoreServer, transport_backends,  # noqa: F401
                          committed_versions, committed_states, CommittedVersion, AdapterSlots, AdapterLease,
                          adapter_serving)
    __all__ += ["WeightSource", "Producer", "Consumer", "StoreServer", "transport_backends", "committed_versions",
                "committed_states", "CommittedVersion", "AdapterSlots", "AdapterLease", "adapter_serving"]
if hasattr(_ferry, "_Metrics"):  # built with the metrics module
    from ._metrics import Metrics, MetricsEndpoint  # noqa: F401
    __all__ += ["Metrics", "MetricsEndpoint"]
    from . import megatron  # noqa: F401 - Megatron-Core layout helpers (ferry.megatron)
    __all__ += ["megatron"]

if hasattr(_ferry, "_serve"):  # built with the tools (the rank entry points)
    from ._rank import serve, fetch  # noqa: F401
    __all__ += ["serve", "fetch"]
