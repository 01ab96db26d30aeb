"""The operator's call path: the plan, the checks and their verdicts, the tensor-parallel layer, the
op bodies.

A call goes down once: :mod:`.plan` (the per-layout state, every check of :mod:`.validation`, the
call's verdict) then :mod:`.tp` (the autograd Function and every collective), which localizes the
call (:mod:`.local_call`) and runs the source's two local primitives. The deferred target verdicts
(:mod:`.verdicts`: what the checks read of the targets, the check a source's finishing kernel
runs, on the group record exchange of :mod:`.group_record`) settle what the kernels found. :mod:`.packed_op` gives the path
outputs of static shapes for the ``torch.library`` ops of :mod:`.ops` (what ``torch.compile`` sees);
:mod:`.dtensor` unwraps DTensor weights.
"""
