"""CPU kernels and their choice by measurement on the running machine (cached per CPU)."""
