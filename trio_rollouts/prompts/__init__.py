"""prompts"""
