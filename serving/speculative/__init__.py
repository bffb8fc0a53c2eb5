"""Speculative decoding: drafters (chain layout, one draft per position), the verify step with
acceptance on device, and the commit of the recurrent state at step `commit_lens - 1`."""
