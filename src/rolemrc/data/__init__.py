"""Data: schemas and validation, readers and mixing, chat templating, collation, datamodule."""
