"""Studies of what selection is worth: the outcome study's protocol v2 (cells, lr grids, paired statistics,
forgetting, frozen teachers), beside the validation and outcome studies of ``fisher_select.training``."""
