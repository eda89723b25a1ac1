"""Every JAX internal jmp_scaler reads, one small module per concern.

jmp_scaler's jaxpr interpreters (``autocast``, the exact skip's select mode, finding the op
that went non-finite) read what JAX's public API does not expose: the jaxpr types of
``jax.extend.core``, the parameters of the higher-order primitives (``scan``, ``while``,
``cond``, ``remat``, ``shard_map``, ``custom_jvp_call``, ``custom_vjp_call``, ``jit``), the
source information of an equation, and the mesh axes along which a value varies. Each is
read here and nowhere else, with the differences between the JAX releases jmp_scaler supports
(jax 0.10.2 to 0.12.x) handled and named where they are read, so that the next release is a
change to one file:

* ``_jaxpr``: the jaxpr types, sub-jaxprs, closing a jaxpr over its constants, binding an
  equation again;
* ``_primitives``: the parameters of the higher-order primitives, as named tuples;
* ``_source``: an equation's source information, its user's frame and its context;
* ``_types``: the mesh axes a value varies along or is unreduced over, its abstract value;
* ``_scaled``: the block-scaled matmul, ``jax.nn.scaled_matmul``, with jax 0.11's CPU lowering
  registered on jax 0.10 (which has none).

A parameter or name that a future JAX no longer has raises :class:`JaxInternalsError`, which
names the JAX version and what is missing, at the first call that needs it: never a silently
wrong dtype.
"""
