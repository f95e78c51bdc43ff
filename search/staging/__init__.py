"""Pipeline staging: the bound-tightened ILP that cuts the step into stages (`stager`, Rhino
section 5) and the forward passes of a step that runs several (`multi_forward`)."""
