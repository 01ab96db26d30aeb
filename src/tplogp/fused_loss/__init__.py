"""The fused loss: ``linear_logp_loss``'s chunk loop over the operator's shared path.

:mod:`.loop` runs the loss chunk by chunk (forward, the terms' closed-form derivatives, the sources'
backward) and returns precomputed gradients behind one autograd node; :mod:`.chunk_gradients` plans
the chunks and assembles the gradients, :mod:`.policy_loss` is the GRPO family's schedule on those
chunks (sequence sums before token gradients), and :mod:`.grad_scaling` scales the kept gradients by
the upstream gradient (a Triton kernel, or torch ops without Triton).
"""
