"""One mesh for tensor, expert and decode-context parallelism: `mesh` (the plan and its mesh),
`rules` (logical axes -> mesh axes, placement), `dcp` (the latent cache spread by token)."""
