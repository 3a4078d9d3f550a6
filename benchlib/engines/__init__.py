"""The gradient engines under comparison (`array_engines`: `Engine`, `ENGINES`, `get_engine`), a model file's step
techniques (`techniques`), and what they share: array namespaces, gradients saved and compared, roles, memory by
module, compiling. The registry's public names are re-exported here; each name is written once, in
`benchlib.engine_names`."""

from benchlib.engines.array_engines import (AUTOCAST_DTYPE, DYNAMO, ENGINE_NAMES, ENGINES, Engine,
                                            NotApplicableError, case_imports, get_engine)

__all__ = ["AUTOCAST_DTYPE", "DYNAMO", "ENGINE_NAMES", "ENGINES", "Engine", "NotApplicableError",
           "case_imports", "get_engine"]
