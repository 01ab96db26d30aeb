"""What tests, the runbook and the pytest plugin check the operator against: references and
tolerances.

:mod:`.reference` computes the operator's outputs the plain way (materialized logits, float64 or the
input dtype) and :mod:`.tolerances` is the one table of tolerances and error slacks the comparisons
use. Public paths: ``tplogp.reference`` and ``tplogp.tolerances``.
"""
