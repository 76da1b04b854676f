"""Run 14: the transformers bench's compile part with the dynamic compile's reductions
looped (triton.persistent_reductions=False), before that became part of
DYNAMIC_INDUCTOR_CONFIG. Usage: python looped_reductions.py --backend cuda --model
qwen3-0.6b --parts compile --json hf-compile.json"""

import sys

import xgraph.compiled as c

c.DYNAMIC_INDUCTOR_CONFIG["triton.persistent_reductions"] = False
from xgraph.integrations.transformers.bench import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
