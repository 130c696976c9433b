"""The code behind `cflow.fileformat`, one module per concern (errors, layout, tensors, writer,
validate, reader). Import from `cflow.fileformat`, which re-exports every public name."""
