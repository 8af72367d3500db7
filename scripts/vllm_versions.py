"""Print the vLLM releases of moe_plugins/stack/versions.py (its one statement of them) for the
shell scripts, without importing the package (no torch needed):

  python3 scripts/vllm_versions.py checked   the CUDA-build releases checked, oldest first
  python3 scripts/vllm_versions.py newest    the newest of them (the GPU scripts' default)
"""
import importlib.util
import sys
from pathlib import Path

path = Path(__file__).resolve().parents[1] / "moe_plugins" / "stack" / "versions.py"
spec = importlib.util.spec_from_file_location("_moe_plugins_versions", path)
versions = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = versions  # dataclasses look their module up by name
spec.loader.exec_module(versions)
checked = versions.VLLM_CHECKED["vllm"]
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "checked":
    print(" ".join(checked))
elif what == "newest":
    print(checked[-1])
else:
    sys.exit(f"usage: {sys.argv[0]} checked|newest (got {what!r})")
