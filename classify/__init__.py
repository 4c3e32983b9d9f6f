"""classify: IMDB sentiment classification on a from-scratch transformer core."""

__version__ = "0.1.0"
