"""Test-wide environment: 8 simulated CPU devices and no writes under $HOME.

Both must be set before jax (or any tool that caches under $HOME) is imported.
"""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_SANDBOX = tempfile.mkdtemp(prefix="agentrefine-test-home-")
for _var, _sub in (("HOME", "home"), ("XDG_CACHE_HOME", "cache"), ("MPLCONFIGDIR", "mpl"), ("HF_HOME", "hf")):
    os.environ[_var] = os.path.join(_SANDBOX, _sub)
    os.makedirs(os.environ[_var], exist_ok=True)
# Nothing in the suite may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
