"""Compare side of h5cmp (torch-free): read dumps, pair tensors, measure errors, report."""
