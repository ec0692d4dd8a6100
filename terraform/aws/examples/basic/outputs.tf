output "bucket_name" {
  value = module.checkpoints.bucket_name
}

output "bucket_arn" {
  value = module.checkpoints.bucket_arn
}

output "run_url_prefix" {
  value = module.checkpoints.run_url_prefix
}

output "writer_policy_arn" {
  value = module.checkpoints.writer_policy_arn
}

output "writer_policy_json" {
  value = module.checkpoints.writer_policy_json
}

output "restore_policy_arn" {
  value = module.checkpoints.restore_policy_arn
}

output "restore_policy_json" {
  value = module.checkpoints.restore_policy_json
}

output "gc_policy_arn" {
  value = module.checkpoints.gc_policy_arn
}

output "gc_policy_json" {
  value = module.checkpoints.gc_policy_json
}
