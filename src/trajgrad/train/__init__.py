"""Training loops, critic, checkpoints and logging (imports the core, never the reverse)."""
