"""dedicated"""
