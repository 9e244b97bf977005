"""Cross-backend conformance suite: rules of docs/semantics.md checked against a float64 oracle.

``topth-ops conformance --backend NAME`` prints the verdict per rule; tests/conformance/
runs the same rules under pytest for every backend available on the machine.
"""

from .rules import RULES, Rule
from . import rules_api, rules_paged, rules_selection, rules_inputs  # noqa: F401,E402 (register their rules)
from .runner import RuleResult, format_table, run_conformance, run_rule

__all__ = ["RULES", "Rule", "RuleResult", "format_table", "run_conformance", "run_rule"]
