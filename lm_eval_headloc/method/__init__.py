"""The method on plain arrays: designs, the Lasso, confirmation, group tests, head types,
and a task's ranking fitted from measurements (no run folder needed)."""
