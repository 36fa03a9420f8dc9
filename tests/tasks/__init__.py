"""Tests of real-task training: datasets, chat templates, the math reward, evaluation."""
